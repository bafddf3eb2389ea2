"""`python -m reprotrain.bench` runs the loop bench (reprotrain/bench/training.py)."""
from reprotrain.bench.training import main

main()
