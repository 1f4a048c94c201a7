"""One module of checks per notebook; each test cell imports the check it calls.

* ``mha_shapes`` -- 01 Multi-head attention, shape by shape
"""
