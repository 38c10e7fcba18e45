"""jaxtrain vs torchref: component by component (test_schedule, test_adamw, test_clip, test_accumulation,
test_model_parity) and end to end."""
