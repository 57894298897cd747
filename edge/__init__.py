"""sim2edge device agent: bundle format and verification, device store, runtimes, pull.

Installable on its own on a Jetson (Python >= 3.8): standard library, numpy, an inference
runtime (ONNX Runtime, or TensorRT where present) and ``cryptography`` for Ed25519.
"""

__version__ = "0.1.0"
