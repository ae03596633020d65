"""ort_autopatch: train selected torch.nn.Module classes through ONNX Runtime, unchanged scripts."""

__version__ = "0.1.0"
