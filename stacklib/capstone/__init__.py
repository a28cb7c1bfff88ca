"""stacklib.capstone: the whole stack, end to end (chapter 16).

    from stacklib.capstone import swap
    ours, rows = swap.swap_matrix(config)      # the same program, each component ours or real

The pieces, one file each:
  swap.py       the swap matrix: one training program; data, modules, optimizer, checkpoint
                and quantization each ours or the real library's (grain, flax.nnx, optax,
                orbax, qwix), chosen by a flag; losses, int8 weights and step times compared

Layer 5: it may import every stacklib layer (and, for the swap matrix, the real libraries).
"""
