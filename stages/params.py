"""Stage params: params.yaml checked whole, whenever it changes at all.

Every stage checks it too, but DVC runs a stage only when a key it reads changed: a key no
stage reads (`dvc exp run -S +lrr=0.05`, DVC's own hint for a typo'd `-S lrr=...`) would skip
every stage and succeed, and stay in params.yaml.
"""

from stages.config import load_params
from stages.lib.cli import run_stage

if __name__ == "__main__":
    run_stage(load_params)
