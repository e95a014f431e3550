"""Monitoring a deployment from outside: a Prometheus scrape config, alerting rules and a Grafana dashboard,
each generated from code (`dyn monitoring`); committed copies live in deploy/monitoring/."""
