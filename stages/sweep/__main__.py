"""`python -m stages.sweep run|worker|status` (`make sweep`)."""
from stages.sweep import main, run_command

run_command(main)
