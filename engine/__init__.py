"""Engine worker: llama.cpp model and context, attention capture, continuous batching, IPC."""
