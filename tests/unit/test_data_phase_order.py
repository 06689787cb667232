from megatron_lite.config.schema import DataConfig
from megatron_lite.data.phases import first_phase, identity, phases_at_resume


def _saved_by_an_earlier_release(cfg: DataConfig) -> list[dict]:
    phases = first_phase(cfg)
    del phases[0]["data"]["order"]  # checkpoints from before the order was recorded
    return phases


def test_a_checkpoint_from_the_length_dependent_order_resumes_with_a_note(tmp_path):
    cfg = DataConfig(prefix=str(tmp_path / "d_text_document"), split_by="documents")
    notes: list[str] = []
    phases = phases_at_resume(_saved_by_an_earlier_release(cfg), cfg, 10, 120, "step 10", notes.append)
    assert len(notes) == 1 and "from sample 120 on" in notes[0] and "may come again" in notes[0]
    assert phases[-1]["data"] == identity(cfg) and len(phases) == 1  # not a data phase of its own
    notes.clear()
    phases_at_resume(phases, cfg, 20, 240, "step 20", notes.append)  # recorded: said once
    assert notes == []


def test_the_token_split_order_never_depended_on_the_length(tmp_path):
    cfg = DataConfig(prefix=str(tmp_path / "d_text_document"), split_by="tokens")
    notes: list[str] = []
    phases = phases_at_resume(_saved_by_an_earlier_release(cfg), cfg, 10, 120, "step 10", notes.append)
    assert notes == [] and phases[-1]["data"] == identity(cfg)


def test_a_checkpoint_from_before_data_phases_gets_the_order_note_too(tmp_path):
    cfg = DataConfig(prefix=str(tmp_path / "d_text_document"), split_by="documents")
    notes: list[str] = []
    phases = phases_at_resume(None, cfg, 10, 120, "step 10", notes.append)
    assert len(notes) == 2 and "records no data identity" in notes[0] and "may come again" in notes[1]
    assert phases[-1]["data"] == identity(cfg)
