"""`import ort_autopatch.auto` activates from the environment (ORT_AUTOPATCH_*), as the
launcher does: patching and the exit report when one is asked for. Log records go through the
`ort_autopatch` logger to the script's own handlers, as a library's do."""

from ort_autopatch.activation import activate_from_environment

activate_from_environment(strict=True)  # a bad setting stops the script that asked for us
