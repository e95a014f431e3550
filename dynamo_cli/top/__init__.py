"""`dyn top`'s model of a deployment: a frontend's /metrics text read into a snapshot (snapshot.py), two
snapshots into per-model and per-worker rows with rates and latency quantiles (frame.py), and the polling
of a frontend over HTTP (scrape.py). Pure but for scrape.py; the CLI draws the rows (cli/top.py)."""
