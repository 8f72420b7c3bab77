"""What operators watch: the admin's dashboard and model pages, Prometheus
metrics, and the health of the periodic jobs."""
