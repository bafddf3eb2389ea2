"""`python -m stages.bench` runs the loop bench (stages/bench/training.py)."""
from stages.bench.training import main

main()
