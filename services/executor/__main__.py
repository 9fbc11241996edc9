"""``python -m services.executor``"""

from services.executor import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("executor", app.build)
