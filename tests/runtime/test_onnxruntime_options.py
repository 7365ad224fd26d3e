"""The onnxruntime backend's session options as onnxruntime itself reports them (`get_session_options`): intra-op
spinning off by default, on with the gateway's `intra_op_spinning` setting; the intra-op threads as given."""

from __future__ import annotations

import pytest

from vit_serve.runtime import LoadSpec, load
from vit_serve.serve.settings import ServeSettings

SPIN = "session.intra_op.allow_spinning"


@pytest.mark.parametrize(("given", "expected"), [({}, "0"), ({"intra_op_spinning": True}, "1")])
def test_spinning_reaches_the_session(tiny_onnx_32, given, expected):
    backend = load(LoadSpec.of(ServeSettings(model=str(tiny_onnx_32), threads=2, **given)))
    opts = backend.session.get_session_options()
    assert opts.get_session_config_entry(SPIN) == expected
    assert opts.intra_op_num_threads == 2
