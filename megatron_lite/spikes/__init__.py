"""Loss-spike and non-finite step tracking: detection, provenance, policies."""

from megatron_lite.spikes.detector import SpikeDetector, Verdict
from megatron_lite.spikes.tracker import SPIKES_FILE, SpikeStop, SpikeTracker, StepContext

__all__ = ["SPIKES_FILE", "SpikeDetector", "SpikeStop", "SpikeTracker", "StepContext", "Verdict"]
