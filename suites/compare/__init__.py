"""The main job: `kvqbench compare` (`run`), its Markdown report and plots
(`report`) and the `kvqbench` command line (`cli`)."""
