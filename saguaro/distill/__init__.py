"""Knowledge distillation of a small draft model from a target (`saguaro distill`)."""
