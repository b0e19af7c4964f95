from django.urls import path

from capacity import api

urlpatterns = [
    path("capacity/", api.CapacityListView.as_view(), name="capacity-list"),
    path("capacity/<int:pk>/", api.CapacityDetailView.as_view(), name="capacity-detail"),
]
