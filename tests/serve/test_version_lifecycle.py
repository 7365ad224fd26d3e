"""A real loaded version's phases (vit_serve.serve.version_state through model_version.ModelVersion): READY once
warmed up, UNLOADED once closed (a second close waits for the first instead of closing twice), and no way back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from gateway_helpers import run, serving, settings_for

from vit_serve.runtime.task import CLASSIFY
from vit_serve.serve.errors import NotReadyError
from vit_serve.serve.version_state import IllegalTransitionError, Phase, VersionState


def test_a_closed_version_is_unloaded_once_answers_503_and_cannot_come_back(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt)) as (_, app):
            repo = app.state.gateway.repository
            mv = app.state.gateway.model()
            ready = (mv.status.phase, mv.warm, mv.error, repo.index())
            x = np.zeros((1, 3, *mv.info.resolution), np.float32)
            assert (await mv.infer(CLASSIFY, x)).outputs["logits"].shape[0] == 1
            await asyncio.gather(mv.close(), mv.close())  # both return once it is closed
            closed = (mv.status.phase, mv.warm, repo.index())
            with pytest.raises(IllegalTransitionError, match="cannot go from UNLOADED to READY"):
                mv.status.move(Phase.READY)
            with pytest.raises(NotReadyError, match="was unloaded before this request was answered"):
                await mv.infer(CLASSIFY, x)
            return mv.name, ready, closed  # the lifespan's stop closes it once more: a no-op

    name, ready, closed = run(scenario())
    assert ready == (Phase.READY, True, None, [VersionState(name, 1, "READY")])
    assert closed == (Phase.UNLOADED, False, [VersionState(name, 1, "UNLOADING")])
