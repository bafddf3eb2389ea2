"""`python -m stages.sweep run|worker|status` (`make sweep`)."""
from stages.lib.cli import run_stage
from stages.sweep import main

run_stage(main)
