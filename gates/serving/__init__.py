"""The serve check: the image's own server in the sandbox, its greedy completions, its speed, the runtime A/B."""
