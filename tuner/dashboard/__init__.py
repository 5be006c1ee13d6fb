"""The dashboard's data: pure functions over a study's trials (data) and capacity curves (curves); `app.py` lays
them out."""
