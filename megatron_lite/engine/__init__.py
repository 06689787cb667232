"""What configures, builds and patches the DeepSpeed engine: its config (``config.py``), the
engine and the patches applied to it (``initialize.py``), its pipeline module (``pipeline.py``),
the ``mpu`` view of our process groups it queries (``mpu.py``), what differs between its
releases (``versions.py``) and every name of DeepSpeed or torch the project relies on that is not
their documented API (``internals.py``). Other folders use DeepSpeed's public API only; a
DeepSpeed upgrade that renames something relied on fails a test naming it."""
