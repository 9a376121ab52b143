"""lm-eval integration: the `kvqbench` model (`model`: a quantized cache under
lm-eval's loglikelihood and generate), running it from Python (`evaluate`), the
`kvqbench-lm-eval` command (`cli`) and the offline tasks (`tasks`)."""
