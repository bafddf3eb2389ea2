"""reprotrain. At the top: the five DVC stages (params, prepare, train, evaluate, export),
`python -m stages.predict` with the inference it shares with serving, and the experiment they
run, what a fork changes (config, models, sources, data, batches, loop, optim, metrics,
checkpoints, weights, runtime, report, distributed). The team's tools live in packages:
tracking, sweep, serving, team, bench, and lib for plumbing that knows no params schema.
"""

import atexit
import sys

if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv:  # `python -m stages.<module>`
    from stages.lib import warm

    # Before any library registers its own: the exit handler that runs last, which ends a
    # finished stage without the interpreter's teardown (stages/lib/warm.py finish).
    atexit.register(warm.end_finished)
    # `python -m stages.<stage>`, as DVC runs it: in the warm process where one serves, which
    # has torch and MLflow imported already (stages/lib/warm.py); otherwise here, as usual.
    if sys.orig_argv[sys.orig_argv.index("-m") + 1].count(".") == 1:
        warm.hand_off(sys.orig_argv[sys.orig_argv.index("-m") + 1])
