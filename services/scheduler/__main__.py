"""``python -m services.scheduler``"""

from services.scheduler import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("scheduler", app.build)
