"""vLLM's OpenAI server (its CPU build) as a bench peer: started once per bench run (its start-up
compiles for a couple of minutes) from the vllm venv, on a free loopback port, with the same
thread count as helios and a KV cache sized like helios' pool; the bench measures it through the
same HTTP calls as helios (scripts/bench.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from helios.launcher import free_port, wait_healthy

SERVED_NAME = "peer"  # the model name requests carry


class VllmServer:
    def __init__(self, python: Path, model: Path, threads: int, kv_gib: int, max_model_len: int, timeout: float = 900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
        command = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(max_model_len),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
        ]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            healthy = wait_healthy(self.process, self.url, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"vLLM: {exc}:\n{self.output()}") from None
        if not healthy:
            self.stop()
            raise RuntimeError(f"vLLM did not become healthy in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
