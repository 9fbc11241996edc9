"""``python -m services.pool_manager``"""

from services.pool_manager import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("pool-manager", app.build)
