"""The run's data: files read row by row (files.py), prompts rendered with the model's chat template
and filtered by length (render.py), the splits and the prompt stream (dataset.py), and what
`raygrpo data` shows (preview.py)."""
