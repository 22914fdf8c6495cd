"""The faces of chatkv: admin CLI (`app.cli`), Gradio UI (`app.ui`), admin HTTP API and metrics routes
(`app.http`)."""
