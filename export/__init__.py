"""Export of trained speculators to serving formats, ONNX graphs and TensorRT engines.

Depends on ``specfoundry.runtime`` only (never on ``specfoundry.train``).
Not built yet: see the export issue.
"""
