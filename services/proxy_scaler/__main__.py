"""``python -m services.proxy_scaler``"""

from services.proxy_scaler import app
from shared.infrastructure import service

if __name__ == "__main__":
    service.main("proxy-scaler", app.build)
