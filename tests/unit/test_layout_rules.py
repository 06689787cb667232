"""Seams of the code base that keep CPU, CUDA and HPU on one path."""

import re

from tests.conftest import REPO

DEVICE_MODULE = REPO / "megatron_lite/distributed/device.py"


def _sources():
    paths = [*(REPO / "megatron_lite").rglob("*.py"), REPO / "pretrain.py", *(REPO / "tools").glob("*.py")]
    for path in paths:
        yield path, path.read_text()


def test_only_the_device_module_touches_cuda_or_habana():
    pattern = re.compile(r"torch\.cuda|\.cuda\(|habana_frameworks|mark_step")
    offenders = [str(p.relative_to(REPO)) for p, text in _sources()
                 if p != DEVICE_MODULE and pattern.search(text)]
    assert offenders == []


def test_model_never_imports_torch_distributed():
    for path in (REPO / "megatron_lite/model").rglob("*.py"):
        assert "torch.distributed" not in path.read_text(), path


def test_only_the_launcher_module_reads_launcher_variables():
    pattern = re.compile(r"environ(\.get)?\s*[\[(]\s*['\"](RANK|WORLD_SIZE|LOCAL_RANK|PMI_|OMPI_|SLURM_)")
    offenders = [str(p.relative_to(REPO)) for p, text in _sources()
                 if p.name != "launcher_env.py" and pattern.search(text)]
    assert offenders == []
