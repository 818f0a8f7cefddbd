using MassTransit;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain;
using ParcelTracker.Domain.Events;

namespace ParcelTracker.Api;

/// <summary>The request body of <c>POST /parcels</c>.</summary>
public sealed record CreateParcelRequest(string? Destination, string? TrackingNumber);

/// <summary><c>POST /parcels</c> and <c>GET /parcels/{id}</c>.</summary>
public static class ParcelEndpoints
{
    public static void MapParcelEndpoints(this IEndpointRouteBuilder app)
    {
        app.MapPost("/parcels", CreateAsync);
        app.MapGet("/parcels/{id:guid}", GetAsync);
    }

    /// <summary>
    /// Registers the parcel and its <see cref="ParcelCreatedEvent"/> in one transaction: the scoped publish endpoint
    /// writes the event into the outbox of this request's DbContext, and SaveChanges commits both, or neither.
    /// </summary>
    private static async Task<IResult> CreateAsync(CreateParcelRequest? request, ParcelDbContext db, IPublishEndpoint publish, TimeProvider clock, CancellationToken cancellationToken)
    {
        var errors = new Dictionary<string, string[]>();
        string destination = request?.Destination?.Trim() ?? "";
        if (destination.Length == 0)
        {
            errors["destination"] = ["A destination is required."];
        }
        else if (destination.Length > 200)
        {
            errors["destination"] = ["The destination is at most 200 characters."];
        }

        string? tracking = request?.TrackingNumber?.Trim();
        if (tracking is not null && (tracking.Length is < 6 or > 32 || !tracking.All(char.IsAsciiLetterOrDigit)))
        {
            errors["trackingNumber"] = ["A tracking number is 6 to 32 letters or digits."];
        }

        if (errors.Count > 0)
        {
            return Results.ValidationProblem(errors);
        }

        var parcel = new Parcel
        {
            Id = NewId.NextGuid(),
            TrackingNumber = tracking ?? "PT" + Guid.NewGuid().ToString("N")[..12].ToUpperInvariant(),
            Destination = destination,
            CreatedAt = clock.GetUtcNow().UtcDateTime,
        };
        db.Parcels.Add(parcel);
        await publish.Publish(new ParcelCreatedEvent(parcel.Id, parcel.TrackingNumber, parcel.Destination), cancellationToken);
        try
        {
            await db.SaveChangesAsync(cancellationToken);
        }
        catch (DbUpdateException) when (tracking is not null)
        {
            // The unique index on tracking_number: nothing was committed, neither the parcel nor its event.
            return Results.Problem(statusCode: StatusCodes.Status409Conflict, title: "Tracking number already registered", detail: tracking);
        }

        return Results.Created($"/parcels/{parcel.Id}", new { id = parcel.Id, trackingNumber = parcel.TrackingNumber });
    }

    private static async Task<IResult> GetAsync(Guid id, ParcelDbContext db, CancellationToken cancellationToken)
    {
        var parcel = await db.Parcels.AsNoTracking().SingleOrDefaultAsync(p => p.Id == id, cancellationToken);
        return parcel is null
            ? Results.Problem(statusCode: StatusCodes.Status404NotFound, title: "Parcel not found", detail: id.ToString())
            : Results.Ok(new
            {
                id = parcel.Id,
                trackingNumber = parcel.TrackingNumber,
                destination = parcel.Destination,
                pickupSlot = parcel.PickupSlot,
                notified = parcel.NotifiedAt is not null,
                notifiedAt = parcel.NotifiedAt,
            });
    }
}
