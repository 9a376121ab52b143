"""lm-eval integration: the `kvqbench` model (`model`: a quantized cache under
lm-eval's loglikelihood and generate) and the offline tasks (`tasks`)."""
