.PHONY: demo test bootstrap

bootstrap:
	./scripts/bootstrap.sh

# The main job on embedded defaults (SQLite, local blob folder, in-process quotas, tiny model on CPU).
demo: bootstrap
	.venv/bin/loraplex demo

test: bootstrap
	./scripts/test.sh
