"""An unloaded model lets go of what its load built in the server's own process: its engine client
and its tokenizer are freed (what the model was, its name and context length, stays for listings),
so a server that loads and unloads models does not grow by a tokenizer per model
(bench/models_memory.py measures the whole server)."""

from __future__ import annotations

import asyncio
import weakref

from ember.config import EngineConfig
from ember.server.config import ServerConfig
from ember.server.state import ModelState
from model_stores import tiny_hf_folder


def test_an_unloaded_model_frees_its_engine_client_and_tokenizer(tmp_path):
    folder = tiny_hf_folder(tmp_path, "qwen3")[1]
    config = ServerConfig(model=str(folder), engine=EngineConfig(max_model_len=256, quantization="none"))

    async def scenario() -> None:
        state = ModelState(config)
        state.start_loading()
        await state.load_task
        assert state.status == "ok", state.failure
        engine, tokenizer = weakref.ref(state.loaded.engine), weakref.ref(state.loaded.tokenizer)
        worker = state.loaded.engine.worker_pid
        await state.unload()
        assert (state.status, state.loaded) == ("unloaded", None)
        assert engine() is None and tokenizer() is None
        assert (state.model.name, state.model.max_model_len) == ("tiny-qwen3", 256)
        assert worker is not None and not _running(worker)
        await state.shutdown()

    asyncio.run(scenario())


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
