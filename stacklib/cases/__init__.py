"""Exercise cases, one module per chapter (`chNN.py`), loaded by `stacklib.grading` by id.

These sit on top of the library like tests do: a case module may import any stacklib
component or real library it compares against.
"""
