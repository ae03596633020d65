"""`import ort_autopatch.auto` activates from the environment (ORT_AUTOPATCH_*)."""

from ort_autopatch import install

install()
