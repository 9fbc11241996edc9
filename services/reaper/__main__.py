"""``python -m services.reaper``"""

from services.reaper import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("reaper", app.build)
