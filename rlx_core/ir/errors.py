"""The project's own error types. Every user-facing failure is one of these."""


class RlxError(Exception):
    """Base of every error RLX raises on bad input."""


class DTypeError(RlxError):
    """A dtype is unknown or not allowed for an op."""


class ShapeError(RlxError):
    """Shapes of an op's inputs disagree with what the op expects."""


class GraphError(RlxError):
    """A graph is malformed: cycle, missing input, unset output, unknown op."""


class SerializeError(RlxError):
    """IR JSON is truncated, malformed or of an unknown version."""


class ProfileError(RlxError):
    """A compile profile key or value is unknown or malformed."""


class BackendError(RlxError):
    """No backend can run the graph, or a backend failed to compile it."""


class PluginError(RlxError):
    """A plugin failed to load or registered something invalid."""


class WeightError(RlxError):
    """A checkpoint is missing, has unexpected tensors, or has tensors of the wrong shape."""


class ModelError(RlxError):
    """A model cannot be built or run for the given input."""
