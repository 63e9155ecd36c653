"""Peer runtimes for scripts/bench.py (llama.cpp via llama-cpp-python, onnxruntime-genai).

Each peer lives in its own virtual environment under ~/.cache/flare/peers (onnxruntime-genai
pulls the plain onnxruntime wheel, which must never land in the main environment) and is
measured by a small runner script (`llamacpp_run.py`, `ortgenai_run.py`) executed with that
environment's python; the runner prints one JSON object. `envs.py` builds and caches the
environments and the models; the main environment needs nothing extra.
"""
