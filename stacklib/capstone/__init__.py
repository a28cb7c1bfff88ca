"""stacklib.capstone: the whole stack, end to end (chapter 16).

    python -m stacklib.capstone --figure dashboard.png     # stages 1-6, every claim checked

    from stacklib.capstone import run, dashboard, swap
    report = run.run_all()                     # the six stages, in order
    report.check()                             # every claim; ClaimFailed names the one that fails
    dashboard.plot(report)                     # loss, goodput, time shares, quality, throughput
    ours, rows = swap.swap_matrix(config)      # the same program, each component ours or real

The pieces, one file each:
  training.py       stages 1-2: chapter 12's sharded trainer with async checkpoints; the same
                    run in a child process killed with SIGKILL, resumed, compared bitwise
  profiling.py      stage 3: one step timed and traced; the op table, MFU, time per op group
  post_training.py  stage 4: GRPO on chapter 13's task from stacklib.align's cached models
                    (where stacklib.align is installed)
  quantization.py   stage 5: int8 PTQ with stacklib.quant, held-out loss and accuracy within
                    stated margins
  serving.py        stage 6: the inference engine behind its OpenAI-compatible server, queried
                    with the openai client; the exported artifact loaded in a fresh process
  run.py            the stages in order, the report and its checks
  claims.py         `claim` and `ClaimFailed`: checks that `python -O` does not remove
  dashboard.py      the one figure
  swap.py           the swap matrix: one training program; data, modules, optimizer, checkpoint
                    and quantization each ours or the real library's (grain, flax.nnx, optax,
                    orbax, qwix), chosen by a flag; losses, int8 weights and step times compared

Layer 5: it may import every stacklib layer (and, for the swap matrix, the real libraries).
"""
