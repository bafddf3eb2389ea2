"""reprotrain, the platform the experiment in stages/ uses: tracking (the tracker the stages log
to, the spool and `make sync`), sweeps, serving, the team's commands, the benches, the warm
process, process supervision and masking. docs/code-map.md maps it beside the experiment.
"""
