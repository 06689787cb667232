"""Loaded by every Python process the tests start (this folder is on their PYTHONPATH): puts
accelerator semantics on torch.distributed (see tests/dist_harness/checks.py) once a process
imports it, and installs the fault injection a test asked for (tests/faults.py); first, before
torch is imported, the start-up shortcut of tests/dist_harness/lazy_dynamo.py. A process that
never imports torch (Ray's own processes, tools that read text) does not pay for it."""

import sys

from tests.dist_harness.checks import install
from tests.dist_harness.lazy_dynamo import install as install_lazy_dynamo
from tests.faults import after_import
from tests.faults import install as install_faults

install_lazy_dynamo()
if "torch.distributed" in sys.modules:
    install()
else:
    after_import("torch.distributed", lambda module: install())
install_faults()
