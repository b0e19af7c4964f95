from django.urls import path

from capacity import views

app_name = "capacity"

urlpatterns = [
    path("<slug:key>/", views.capacity_page, name="page"),
]
