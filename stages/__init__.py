"""The experiment: the five DVC stages (params, prepare, train, evaluate, export) and
`python -m stages.predict`, and what they run. The platform they use (tracking, sweeps,
serving, the team's commands, benches, the warm process) is the `reprotrain` package beside it;
docs/code-map.md maps both.
"""

from reprotrain.warm import hand_off_stage

hand_off_stage()  # `python -m stages.<stage>` runs in the warm process where one serves
