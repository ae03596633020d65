"""The backends, one package each: everything only that backend uses lives in its package.

- `ort/`: the maintained, inference-only `onnxruntime` (option value `ort`, the default where
  the training build is absent): forward and backward graphs from torch's autograd
  (aot_autograd), lowered to ONNX, run as two inference sessions.
- `ort_training/`: ONNX Runtime's last training build, `onnxruntime-training` 1.19.2 (option
  value `ort-training`): the TorchScript export, ORT's gradient builder and TrainingAgent.

Each package's `backend.py` holds the class that implements `engine.backend.Backend`; the
registry (`engine.backend.BACKENDS`) names it. Nothing outside a backend's package imports it,
except through the registry.
"""
