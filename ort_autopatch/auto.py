"""`import ort_autopatch.auto` activates from the environment (ORT_AUTOPATCH_*), as the
launcher does: patching, logs on stderr (rank 0) and the exit report when one is asked for."""

from ort_autopatch.activation import activate
from ort_autopatch.config import load_config

activate(load_config())
