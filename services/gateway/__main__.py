"""``python -m services.gateway``"""

from services.gateway import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("gateway", app.build)
