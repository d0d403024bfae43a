"""DCP's .metadata is a pickle: a crafted one must be refused by name before it runs anything,
and what torch writes there must still load (hybrid2d/checkpoint/safe_metadata.py)."""

import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hybrid2d.checkpoint.reader import cause, read_metadata
from hybrid2d.checkpoint.safe_metadata import MetadataReader, SafeLoadPlanner
from hybrid2d.errors import ConfigError


def _save(path) -> dict:
    state = {
        "model": {"w": torch.randn(3, 5), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "trainer": {"step": 3, "schedule": {"lrs": [1e-3, 2.0], "none": None}},
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_what_dcp_writes_loads_through_the_allow_list(tmp_path):
    state = _save(tmp_path / "ck")
    meta = read_metadata(tmp_path / "ck")
    plain = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())  # torch's own reading
    assert meta.state_dict_metadata == plain.state_dict_metadata
    assert meta.storage_data == plain.storage_data and meta.storage_data
    loaded = {"model": {"w": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16)}}
    dcp.load(loaded, storage_reader=MetadataReader(str(tmp_path / "ck")), no_dist=True)
    torch.testing.assert_close(loaded["model"], state["model"], rtol=0, atol=0)


class _RunsCode:
    """Unpickled, this would call its target: the pickle names a callable and its arguments."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


@pytest.mark.parametrize(
    "target, named",
    [
        (exec, "builtins.exec"),
        (pathlib.Path.touch, "pathlib.Path.touch"),  # an allowed module, a method of it
    ],
)
def test_a_metadata_pickle_that_would_run_code_is_refused_by_name(tmp_path, target, named):
    _save(tmp_path / "ck")
    marker = tmp_path / "ran"
    payload = (
        _RunsCode(exec, f"open({str(marker)!r}, 'w').close()")
        if target is exec
        else _RunsCode(target, marker)
    )
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(ConfigError) as e:
        read_metadata(tmp_path / "ck")
    assert not marker.exists()  # nothing ran
    message = str(e.value)
    assert message.startswith(f"checkpoint {tmp_path / 'ck'}: .metadata names {named}, ")
    assert "refused to unpickle it (unpickling can run code)" in message
    assert "\n" not in message
    with pytest.raises(pickle.UnpicklingError):  # dcp.load's own reading is guarded too
        MetadataReader(str(tmp_path / "ck")).read_metadata()
    assert not marker.exists()


def test_a_non_tensor_entry_that_would_run_code_is_refused_and_plain_ones_load(tmp_path):
    """A resume reads the trainer's non-tensor state, which DCP unpickles in full
    (torch.load(weights_only=False)); SafeLoadPlanner reads it with weights_only=True first."""
    marker = tmp_path / "ran"
    state = {"trainer": {"step": 7, "lrs": [0.5, 0.25], "evil": None}}
    path = tmp_path / "ck"
    dcp.save(
        {
            "trainer": {
                "step": 7,
                "lrs": [0.5, 0.25],
                "evil": _RunsCode(exec, f"open({str(marker)!r}, 'w').close()"),
            }
        },
        checkpoint_id=str(path),
        no_dist=True,
    )
    assert not marker.exists()
    with pytest.raises(CheckpointException) as e:  # DCP's wrapper of each rank's error
        dcp.load(
            state,
            storage_reader=MetadataReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert cause(e.value) == (
        "UntrustedPickle: its entry trainer.evil is not a plain value, container or tensor: "
        "refused to unpickle it (unpickling can run code)"
    )
    assert not marker.exists()
    plain = {"trainer": {"step": 0, "lrs": [0.0, 0.0]}}
    dcp.load(
        plain, storage_reader=MetadataReader(str(path)), planner=SafeLoadPlanner(), no_dist=True
    )
    assert plain == {"trainer": {"step": 7, "lrs": [0.5, 0.25]}}
