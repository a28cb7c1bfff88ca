"""Programs that use several stacklib components together, as a user would.

They sit outside the layering (like `stacklib.cases`): chapters and tests run them,
and they may import any component and real library.
"""
