.PHONY: demo test bootstrap chart-configs

bootstrap:
	./scripts/bootstrap.sh

# The main job on embedded defaults (SQLite, local blob folder, in-process quotas, tiny model on CPU).
demo: bootstrap
	.venv/bin/loraplex demo

test: bootstrap
	./scripts/test.sh

# Copies tuning_configs/ into the Helm chart (charts cannot read files outside their folder, nor follow links).
# Run after `loraplex tune` writes new configs; tests/deploy checks that the two copies match.
chart-configs:
	rm -rf deploy/helm/loraplex/files/tuning_configs
	mkdir -p deploy/helm/loraplex/files/tuning_configs
	cp -R tuning_configs/. deploy/helm/loraplex/files/tuning_configs/
	find deploy/helm/loraplex/files/tuning_configs -name '__pycache__' -prune -exec rm -rf {} +
	rm -rf deploy/helm/loraplex/files/dashboards
	mkdir -p deploy/helm/loraplex/files/dashboards
	cp deploy/grafana/*.json deploy/helm/loraplex/files/dashboards/
