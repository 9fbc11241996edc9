"""One package per service. Services never import each other (import-linter checks it);
they share only :mod:`shared` and talk only through NATS."""
