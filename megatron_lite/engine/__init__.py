"""Everything that knows DeepSpeed: its config (``config.py``), the engine and the patches
applied to it (``initialize.py``), its pipeline module (``pipeline.py``), the ``mpu`` view of our
process groups it queries (``mpu.py``), what differs between its releases (``versions.py``) and
every private name of DeepSpeed or torch the project relies on (``internals.py``). A DeepSpeed
upgrade is a change to this folder."""
